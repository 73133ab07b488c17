package LlamaBalance;

# What the tests of llama_session_balance (t/108 to t/111) do alike: new
# sessions of a home; a home made busy, its two slots held by the fake
# backend, while a third session of that home, with a file, comes back.

use strict;
use warnings;

use LlamaTest;
use Test::More;
use Time::HiRes qw(sleep time);

# owners "names" of two slots each over one store (shared=on, saves 200 ms
# after a turn), fake backends (with "script"), a front that balances by
# "balance" (llama_session_balance); "ports": the owners' ports, the same
# ring on every run.  Returns the running LlamaTest
sub fleet {
    my (%o) = @_;
    my $t = LlamaTest->new(workers => 2);
    my $dir = $t->dir;
    LlamaTest::slots_dir("$dir/slots");
    $t->{owner_port} = { %{ $o{ports} } } if $o{ports};
    $t->fake(name => $_, np => 2, slots => "$dir/slots",
             script => $o{script} // {})
        for @{ $o{names} };
    $t->nginx($t->owners(names => $o{names},
                         balance => $o{balance} // 'llama_session_balance',
                         zone => ' slots=2 shared=on save_idle=200ms',
                         store => sub { "$dir/slots" }, fail => '1s'));
    return $t;
}

# three new sessions of one home ($home: a session id's home), turned once
# each through the front $front (the third first, so that it has a file);
# the other two then held in both slots of that home by its fake backend
# (of $owners) until release() is called
sub hold_home {
    my (%o) = @_;
    my ($front, $owners, $home) = @o{qw(front owners home)};

    my (%by, $h1, $h2, $h3);
    my $n = 0;
    while (!$h3) {
        my $sid = 'h' . $n++;
        my $list = $by{ $home->($sid) } //= [];
        push @$list, $sid;
        ($h1, $h2, $h3) = @$list if @$list == 3;
    }
    my $busy = $home->($h1);
    diag("$h1, $h2, $h3: home $busy");

    for my $sid ($h3, $h1, $h2) {
        is($front->chat_turn($sid)->{backend}, $busy, "$sid: home $busy");
        sleep 0.5;    # save_idle: its file
    }

    my $until = $owners->dir . '/release';
    unlink $until;
    $owners->fake_script({ completion => { match => "(?:$h1|$h2)\\b",
                                           delay_ms => 1,
                                           until => $until } }, $busy);
    my @held = map { $front->async_post('/v1/chat/completions',
                                        { messages => [ @{ $front->{conv}{$_} } ],
                                          max_tokens => 2 },
                                        headers => { 'X-Session-Id' => $_ }) }
               $h1, $h2;
    sleep 1;

    my $release = sub {
        open my $fh, '>', $until or die;
        close $fh;
        for my $h (@held) {
            is($front->async_wait($h, 30)->{status}, 200, 'a held turn ends');
        }
        $owners->fake_script({}, $busy);
    };

    return { busy => $busy, sessions => [ $h1, $h2, $h3 ],
             release => $release };
}

# hold_home(), then the third session comes back while the two are held:
# it goes to another owner at once and restores there.  Returns hold_home()'s
# with the owner it went to (moved)
sub busy_home {
    my (%o) = @_;
    my $front = $o{front};

    my $hh = hold_home(%o);
    my ($busy, $h3) = ($hh->{busy}, $hh->{sessions}[2]);

    my $t0 = time;
    my $r = $front->chat_turn($h3);
    my $secs = time - $t0;
    is($r->{status}, 200, "$h3 while ${busy}'s slots are held");
    isnt($r->{backend}, $busy, "$h3 went to another owner ($r->{backend})");
    is($r->{action}, 'restore', 'a restore there');
    ok($r->{cached} > 0.9 * $r->{prompt},
       "from its file: $r->{cached} of $r->{prompt} cached");
    ok($secs < 5, sprintf('at once (%.1f s), not after the held turns',
                          $secs));

    $hh->{release}->();
    $hh->{moved} = $r->{backend};
    return $hh;
}

# a new session id of home $want ($home: a session id's home), "$prefix<n>",
# none given twice
my %issued;
sub new_of {
    my ($home, $want, $prefix) = @_;
    my $i = 0;
    $i++ until $home->("$prefix$i") eq $want && !$issued{"$prefix$i"}++;
    return "$prefix$i";
}

1;
