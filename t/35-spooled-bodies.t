#!/usr/bin/perl

# The isolation review: a body nginx wrote to a temporary file waits for
# its slot there, not in the worker's memory (30 waiting requests of 8 MB
# added 249 MB to a worker when each was copied into its pool and kept);
# what a warm start needs of it is read again from the file, then.

use strict;
use warnings;

use FindBin;
use lib "$FindBin::Bin/lib";

use LlamaTest;
use Test::More;

# reprime=off: the fake backend, in Perl, takes seconds to render a 2 MB
# body through its template; the re-prime of spooled bodies is the last
# part's
my $t = LlamaTest->new(workers => 1);
$t->fake(np => 1);
$t->nginx($t->site(
    zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%% reprime=off;',
    server => q{
        client_max_body_size 16m;
        client_body_buffer_size 16k;
    },
    location => q{
        llama_session_wait_timeout 300s;
        add_header X-S-Action $llama_session_action always;
    },
    # the test sees the queue there
    extra => 'location /api/ { llama_session_api llama; }'));

my $rss = sub { my $s = `ps -o rss= -p $_[0]`; $s =~ s/\s//g; $s || 0 };
my ($worker) = split ' ', `pgrep -P \$(cat ${\ $t->dir}/nginx.pid)`;

my $system = join ' ', map { "Standing rule $_ of the desk." } 1 .. 300;
sub body {
    my ($n, $mb) = @_;
    return { messages => [ { role => 'system', content => $system },
                           { role => 'user', content => "request $n " . ('p' x ($mb * 1024 * 1024)) } ],
             max_tokens => 4 };
}

# a first request holds the slot until the file appears
my $gate = $t->dir . '/gate';
$t->fake_script({ completion => { until => $gate, match => 'holder' } });
my $holder = $t->async_post('/v1/chat/completions',
                            { messages => [ { role => 'user', content => 'holder' } ] },
                            headers => { 'X-Session-Id' => 'holder' });
$t->wait_for(sub { grep { ($_->{headers}{'x-session-id'} // '') eq 'holder' }
                   @{ $t->fake_calls } }, 30)
    or diag 'the holder never reached the backend';

my $before = $rss->($worker);
my @h = map { $t->async_post('/v1/chat/completions', body($_, 2),
                             headers => { 'X-Session-Id' => "w$_" }) } 1 .. 10;
# all read and queued
$t->wait_for(sub { ($t->get('/api/sessions/current')->{json}{waiting} // 0)
                   >= 10 }, 60)
    or diag 'the ten never waited in the queue';
my $grew = $rss->($worker) - $before;
SKIP: {
    # AddressSanitizer keeps freed memory in quarantine, valgrind its own
    skip 'memory figures under ASan or valgrind are the tool\'s', 1
        if $ENV{ASAN_OPTIONS} || $ENV{TEST_NGINX_VALGRIND};
    ok($grew < 8 * 1024, 'ten requests of 2 MB wait for the slot: the worker '
       . 'grew by ' . int($grew / 1024) . ' MB (< 8)');
}

open my $fh, '>', $gate or die;
close $fh;
is($t->async_wait($holder)->{status}, 200, 'the holder ends');
my @st = map { $t->async_wait($_, 300)->{status} } @h;
is_deeply(\@st, [ (200) x 10 ], 'then all ten are served');
$t->fake_script({});

# a warm start whose body is in a file: the prime has the system prompt
my $calls = @{ $t->fake_calls };
my $r = $t->post('/v1/chat/completions', body('warm', 1),
                 headers => { 'X-Session-Id' => 'w-new' });
is($r->{status}, 200, 'a new session with a spooled 1 MB body');
like($r->{headers}{'x-s-action'}, qr/^(warm|fresh)$/, 'starts from its system prompt');
my @prime = grep { ($_->{body} // '') =~ /Standing rule 300 of the desk/
                   && ($_->{body} // '') !~ /pppp/ }
            @{ $t->fake_calls }[$calls .. $#{ $t->fake_calls }];
ok(@prime, 'the prime had the system prompt, read again from the file, '
   . 'and none of the conversation');

$t->stop;

# the re-prime of a turn whose body nginx wrote to a file: the turn file
# has the body, read from there, and the swap re-primes with it
{
    my $t = LlamaTest->new(workers => 1);
    $t->fake(np => 1);
    $t->nginx($t->site(
        zone => 'llama_session_zone zone=llama:1m store=%%SLOTS%%;',
        server => 'client_body_buffer_size 16k;'));
    my $big = { messages => [ { role => 'user',
                                content => 'spooled ' . ('q' x 100_000) } ] };
    is($t->post('/v1/chat/completions', $big,
                headers => { 'X-Session-Id' => 'spool' })->{status}, 200,
       'a turn with a 100 kB body');
    ok($t->log_lines(qr/a client request body is buffered to a temporary file/),
       'which nginx wrote to a file');
    $t->post('/v1/chat/completions',
             { messages => [ { role => 'user', content => 'other' } ] },
             headers => { 'X-Session-Id' => 'other' });
    ok($t->log_lines(qr/re-primed "spool-\w+" on slot 0/),
       'its swap re-primed it, from the body kept');
    my ($apply) = grep { $_->{path} eq '/apply-template' } @{ $t->fake_calls };
    cmp_ok($apply ? $apply->{body_len} : 0, '>', 100_000,
           'the render had the spooled body (' . ($apply ? $apply->{body_len} : 0)
           . ' bytes)');
    $t->stop;
}

done_testing;
