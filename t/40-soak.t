#!/usr/bin/perl

# A soak with the real llama-server on one slot: randomized turns of 20
# conversations from 4 clients at once through 4 workers, with clients
# that leave at random moments and one restart of llama-server half way.
# Every reply's cached tokens must come from its own conversation: all the
# conversations share a long system prompt, then each has a marker of its
# own, so a request that ran on another conversation's cache would show
# exactly the shared prefix as cached.  At the end every saved file is
# restored and must be its own conversation's.
#
# SOAK_REQUESTS (default 120) sets the number of requests; `make soak`
# runs 10,000 and writes the figures to SOAK_REPORT (JSON).

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use POSIX qw(:sys_wait_h);
use Test::More;
use IO::Handle;
use Time::HiRes qw(sleep time);

my $JSON = $LlamaTest::JSON;
my $N = $ENV{SOAK_REQUESTS} // 120;
my $CLIENTS = 4;

my $t = LlamaTest->new(workers => 4, timeout => 300);
my $llama = $t->llama(ctx => 8192);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
    upstream => 'keepalive 4;',
    server => 'add_header X-S-Action $llama_session_action always;',
    location => q{
        llama_session_wait_timeout 120s;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_read_timeout 120s;
    }));

my @names = qw(Alpha Bravo Charlie Delta Echo Foxtrot Golf Hotel India
               Juliett Kilo Lima Mike November Oscar Papa Quebec Romeo
               Sierra Tango);
my $system = join ' ', ('You are a careful assistant who answers briefly.')
                       x 12;

sub marker { my $n = $_[0]; "Conversation $n " . lc("$n $n $n $n") . ':' }

sub body {
    my ($name, $turns) = @_;
    return { model => 'm', max_tokens => 3, temperature => 0, seed => 1,
             messages => [ { role => 'system', content => $system },
                           { role => 'user', content => marker($name) },
                           @$turns ] };
}

# the shared prefix, in tokens: two conversations one after the other
# straight at llama-server, on an erased slot
$t->post("/slots/0?action=erase", {}, port => $llama);
my $r1 = $t->post('/v1/chat/completions', body('Xray', []), port => $llama);
my $r2 = $t->post('/v1/chat/completions', body('Yankee', []), port => $llama);
my $cross = $r2->{json}{usage}{prompt_tokens_details}{cached_tokens};
my $full = $r1->{json}{usage}{prompt_tokens};
ok($cross && $cross > 100, "conversations share $cross tokens of prefix");
cmp_ok($full, '>', $cross + 5, "and each has its own after it ($full)");

# the clients: each owns five conversations and keeps their turns
my $restart_at = int($N / 2);
my @kids;
for my $c (0 .. $CLIENTS - 1) {
    my $file = $t->dir . "/soak.$c.jsonl";
    my $pid = fork();
    die "fork: $!" unless defined $pid;
    if ($pid == 0) {
        $t->{stopped} = 1;
        srand($c + 1);
        open my $out, '>', $file or die;
        # each record as it is made: the parent counts them to restart
        # llama-server half way
        $out->autoflush(1);
        my %turns;
        my @mine = @names[ $c * 5 .. $c * 5 + 4 ];
        for my $i (1 .. int($N / $CLIENTS)) {
            my $name = $mine[ int rand @mine ];
            my $turns = $turns{$name} //= [];
            my @ask = (@$turns, { role => 'user',
                                  content => "question $i of $name" });
            my $body = body($name, [ @ask ]);
            my $rec = { client => $c, i => $i, name => $name,
                        turns => scalar @$turns, t0 => time };
            if (rand() < 0.08) {
                # a client that leaves at a random moment
                my $s = $t->raw_open('POST', '/v1/chat/completions', $body,
                                     headers => { 'X-Session-Id' => $name });
                sleep rand(0.4);      # a random moment, on purpose
                close $s;
                $rec->{left} = 1;
                @$turns = ();     # what the slot holds now is unknown
            } else {
                my $r = $t->post('/v1/chat/completions', $body,
                                 headers => { 'X-Session-Id' => $name });
                $rec->{status} = $r->{status};
                $rec->{action} = $r->{headers}{'x-s-action'};
                $rec->{cached} = $r->{json}{usage}{prompt_tokens_details}
                                   {cached_tokens};
                $rec->{prompt} = $r->{json}{usage}{prompt_tokens};
                if ($r->{status} == 200) {
                    my $answer = $r->{json}{choices}[0]{message}{content}
                                 // '';
                    @$turns = (@ask, { role => 'assistant',
                                       content => $answer });
                    # conversations restart now and then, as chats do
                    @$turns = () if @$turns > 12;
                }
            }
            $rec->{t1} = time;
            print $out $JSON->encode($rec), "\n";
        }
        close $out;
        POSIX::_exit(0);
    }
    push @kids, $pid;
}

# one restart of llama-server half way (by the count of requests done)
my $t0 = time;
my $restarted = 0;
my ($down_from, $down_to) = (0, 0);
while (grep { waitpid($_, WNOHANG) == 0 } @kids) {
    if (!$restarted) {
        my $done = 0;
        for my $c (0 .. $CLIENTS - 1) {
            my $s = $t->read_file("soak.$c.jsonl");
            $done += () = $s =~ /\n/g;
        }
        if ($done >= $restart_at) {
            $down_from = time;
            $t->stop_llama;
            $t->llama(port => $llama, ctx => 8192);
            $down_to = time;
            $restarted = 1;
        }
    }
    sleep 0.2;
}
waitpid($_, 0) for @kids;
my $secs = time - $t0;

my @recs;
for my $c (0 .. $CLIENTS - 1) {
    push @recs, map { $JSON->decode($_) }
                grep { /\S/ } split /\n/, $t->read_file("soak.$c.jsonl");
}

my @done = grep { !$_->{left} } @recs;
my @ok = grep { ($_->{status} // 0) == 200 } @done;
my @bad = grep { ($_->{status} // 0) != 200 } @done;

# while llama-server restarts, requests that need a slot call get 502
# (it is down) or 503 (it loads its model), and only then
my @down = grep { ($_->{status} == 502 || $_->{status} == 503)
                  && $_->{t1} >= $down_from - 1 && $_->{t0} <= $down_to + 1 }
           @bad;
my %down = map { ("$_->{client}.$_->{i}" => 1) } @down;
@bad = grep { !$down{"$_->{client}.$_->{i}"} } @bad;
my %actions;
$actions{ $_->{action} // '-' }++ for @ok;

# a reply that ran on another conversation's cache shows the shared prefix
my @crossed = grep { defined $_->{cached} && $_->{cached} > 1
                     && $_->{cached} <= $cross + 4 } @ok;
my $reused = grep { ($_->{cached} // 0) > $cross + 4 } @ok;

is(scalar @recs, $CLIENTS * int($N / $CLIENTS), "$N requests were made");
ok($restarted, 'llama-server restarted half way');
is(scalar @bad, 0, 'every request whose client stayed got 200, or 502 '
                   . 'or 503 while llama-server restarted')
    or diag $JSON->encode([ @bad[0 .. ($#bad > 4 ? 4 : $#bad)] ]);
diag sprintf('%d requests got 502/503 during the restart (%.1f s)',
             scalar @down, $down_to - $down_from);
is(scalar @crossed, 0,
   'no reply ran on another conversation\'s cache (0 cross-session reuse)')
    or diag $JSON->encode([ @crossed[0 .. ($#crossed > 4 ? 4 : $#crossed)] ]);
cmp_ok($reused, '>', @ok / 4,
       "$reused replies reused their own conversation's cache");

# every saved file is its own conversation's
my $files_ok = 0;
my @files = glob($t->dir . '/slots/*.bin');
for my $name (@names) {
    my $r = $t->post('/v1/chat/completions',
                     body($name, [ { role => 'user', content => 'last' } ]),
                     headers => { 'X-Session-Id' => $name });
    next unless ($r->{headers}{'x-s-action'} // '') eq 'restore';
    my $cached = $r->{json}{usage}{prompt_tokens_details}{cached_tokens} // 0;
    if ($cached > $cross + 4) {
        $files_ok++;
    } else {
        diag "$name: restored with $cached cached tokens";
    }
}
cmp_ok(scalar @files, '>', 0, scalar(@files) . ' files were saved');
is($files_ok, scalar(grep { my $n = $_; grep { /\Q$n\E-/ } @files } @names),
   'every conversation restored from its file finds its own prefix');

my $report = {
    requests => scalar @recs, seconds => sprintf('%.0f', $secs),
    clients_left => scalar(grep { $_->{left} } @recs),
    served => scalar @ok, failed => scalar @bad,
    backend_down_502_503 => scalar @down,
    restart_seconds => sprintf('%.1f', $down_to - $down_from),
    actions => \%actions,
    shared_prefix_tokens => $cross, own_cache_reuse => $reused,
    cross_session_reuse => scalar @crossed, files => scalar @files,
    files_restored_own => $files_ok, llama_server_restarts => $restarted,
};
diag 'soak: ' . $JSON->encode($report);
if ($ENV{SOAK_REPORT}) {
    open my $fh, '>', $ENV{SOAK_REPORT} or die;
    print $fh $JSON->encode($report), "\n";
    close $fh;
}

$t->stop;
done_testing;
